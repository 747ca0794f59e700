"""Workers: run job shards through the engine, from Celery tasks or in-process (`pipeline run`)."""
