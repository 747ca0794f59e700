"""`python -m cli`."""
from cli import main

if __name__ == "__main__":   # not again in a spawned child (pipeline.engine.tokenizer_pool), which imports this module
    main()
