"""A schedule as the arrays of one device call, and the programs that run them.
``builder.BatchBuilder`` pads a ``SchedulerOutput`` into a ``batch_metadata.BatchMetadata``
(the one host/device contract) of a shape ``batch_shapes`` allows (``bucket_ladder``'s
rungs), keeping per-row settings across steps (``batch_rows``) and penalty table rows
(``penalty_slots``); ``step_features`` says which optional sampling work a batch needs;
``program_set.ProgramKey`` names every program and keys the caches."""
