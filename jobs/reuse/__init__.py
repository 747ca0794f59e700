"""Answers reused across jobs: a request's answer key and the stored answers it finds."""
