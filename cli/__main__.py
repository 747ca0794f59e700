"""`python -m cli`."""
from cli import main

main()
