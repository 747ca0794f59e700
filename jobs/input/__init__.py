"""Input files: each line checked (ours and OpenAI batch lines), the file scanned in one pass and cut into shard files."""
