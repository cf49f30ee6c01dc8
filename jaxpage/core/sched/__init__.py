"""What runs in each step, and what its tokens do to the requests. ``scheduler.Scheduler``
owns the queues and the admission, preemption and swap decisions, and its parts as
objects with their own state: ``ahead_of_host`` (decisions made while a call still runs:
multi-step, chaining, overlapped scheduling), ``speculation`` (which rows carry
proposals), ``lora_seating`` (adapter slots), ``step_apply`` (the one way sampled tokens
reach the requests, from a call's ``step_result``) with ``steady_batch`` (the persistent
batch that owns steady decoding's tokens). ``schedule_output`` is what a step runs. Nothing here calls the
device: a draft model's proposals are asked for by the engine."""
