"""Results: the one result row, Parquet shard files, OpenAI output files, job statistics, ending a job, deleting old results."""
