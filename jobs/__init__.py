"""Job inputs and outputs: validating and sharding request files, OpenAI Batch API shapes."""
