"""The child process of jobs.input.file_scan: scans one line range of an input file.

Reads a pickled RangeTask on standard input, writes the pickled RangeResult on standard
output; it imports only what checking lines needs (no broker, database or engine).
"""
import pickle
import sys

from jobs.input.file_scan import scan_range

if __name__ == "__main__":
    result = scan_range(pickle.load(sys.stdin.buffer))
    sys.stdout.buffer.write(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
