"""The offline side of the pager: traces analysed, residency policies replayed against a cost model and Belady's
optimum, pool sizes swept, synthetic traces, plots. Needs no model (numpy, no torch); imports the pager's top level
(plans, traces, the planner), never `moelane.pager.live`.
"""
