"""Trains kvserve's embedded default model and its draft model (``python -m
tools.default_model.train_default``); kvserve ships and loads only the checkpoints it
writes into ``kvserve/default_model/``."""
