"""The OpenAI-compatible HTTP server over the lanes engine (`create_app` in app.py; the `moelane serve` command that
runs it is `moelane.commands.serve`, which this package never imports).

Layers: protocol.py and chat_request.py (wire models) -> app.py (routes, admission) -> generation.py (one request on
the engine: token bridge, text, stop strings) -> the engine; errors.py maps every failure to an OpenAI error body
in one place; metrics.py and cost.py count what requests cost. docs/server.md describes the API and its extension field.
"""
