"""The OpenAI Files and Batches API over HTTP (`pipeline serve`): a thin layer over jobs and workers.

An entry surface like the CLI's job commands: it makes jobs with jobs.submission, sends their
shards with workers.broker, cancels and exports them as the CLI does. Nothing below imports
it (tests/project/test_layers.py). app (the FastAPI app and how it is served), auth (bearer keys),
errors (OpenAI error objects), uploads (multipart uploads streamed into the data root, size
limited), files and batches (the routes), batch_files (a batch's output and error files).
"""
