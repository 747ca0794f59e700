"""Models and everything about loading them: the Llama-family module (llama.py), which
architectures map to it (architectures.py), reading a Hugging Face directory's weights and
tokenizer (loader.py), checking a model directory (model_dir.py) and the bundled model's
one-time conversion (bundled.py). Importing the package imports no torch: model_dir and
bundled are used by the CLI and the jobs side.
"""
