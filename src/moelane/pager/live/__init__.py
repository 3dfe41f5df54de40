"""The live side of the pager: the expert store a running model fetches its experts through, and what it uses at run
time (slot table, storage levels, precision tiers, prefetch, statistics, the budget and how it is built), plus the
trace recorder that hooks a live model. Imports the pager's top level (plans, traces, the planner) and the model,
never `moelane.pager.lab`.
"""
