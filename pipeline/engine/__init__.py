"""The step loop: the engine (engine.py) admits requests (admission.py), schedules
(scheduler.py, over the block manager's paged KV blocks and its prefix cache), runs the
model (model_runner.py, CUDA graphs in cuda_graphs.py), samples, drafts and verifies
(speculative.py), forks n > 1 choices (choices.py) and retires each request's sequences
(output_processor.py over sequence.py and detokenizer.py), a step at a time or overlapped
(step_in_flight.py); engine_loop.py shares one engine between threads; memory_budget.py
sizes the batch and the KV cache (on CUDA after memory_profile.py's profiling step).
Importing the package imports no torch.
"""
