"""One module per model family, named by its `model_type` (`family.family_of` imports it), each with a typed config
and a `FAMILY` that builds it. No module here imports another: shared parts live in `moelane.model`."""
