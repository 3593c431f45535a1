"""The Batch API's parts that are not HTTP: the JSONL lines, the durable store, the runner
that feeds lines to the engine as background requests."""
