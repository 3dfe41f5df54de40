"""Which channel of a gpt-oss reply a token belongs to (OpenAI's "harmony" format).

gpt-oss answers a chat prompt (which ends `<|start|>assistant`) with messages such as
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`: its
reasoning in the analysis channel, the answer in the final one. `Channels.push` reads the reply token by token and
says, for each, the channel of the message body it is part of, or None for the structure around the bodies
(special tokens, the role, the channel's name). A chat client gets the final channel as `content` and the others as
`reasoning_content`.
"""

from __future__ import annotations

from moelane.model.tokenizer import Tokenizer

SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
FINAL = "final"


class Channels:
    """The state of one reply. Starts in a message header (the prompt ends with `<|start|>assistant`)."""

    def __init__(self, tokenizer: Tokenizer, ids: dict[str, int]) -> None:
        self._tokenizer = tokenizer
        self._start, self._channel, self._message = ids["<|start|>"], ids["<|channel|>"], ids["<|message|>"]
        self._ends = {ids["<|end|>"], ids["<|return|>"], ids["<|call|>"]}
        self._constrain = ids["<|constrain|>"]
        self._name: list[int] | None = None  # the channel name's ids while reading it
        self._named = False  # the name is read (a `<|constrain|>` follows it: "commentary <|constrain|>json")
        self._body: str | None = None  # the channel whose message body is being read

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> Channels | None:
        """Channels for a tokenizer with harmony's special tokens, else None (the model does not speak it)."""
        ids = {name: tokenizer.token_id(name) for name in SPECIALS}
        if any(i is None for i in ids.values()):
            return None
        return cls(tokenizer, {name: i for name, i in ids.items() if i is not None})

    def push(self, token: int) -> str | None:
        """The channel of the message body `token` is part of, or None for structure."""
        if token == self._message:
            words = self._tokenizer.decode(self._name or []).split()
            self._body, self._name = (words[0] if words else FINAL), None
            return None
        if token == self._channel:
            self._name, self._body, self._named = [], None, False
            return None
        if token == self._start or token in self._ends:
            self._name = self._body = None
            return None
        if self._body is None:
            self._named = self._named or token == self._constrain
            if self._name is not None and not self._named:
                self._name.append(token)
            return None
        return self._body
