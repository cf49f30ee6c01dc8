"""What runs before an engine takes requests: how many KV blocks (``kv_sizing``), a byte
KV cache's scales (``kv_calibration``), a checkpoint's sampling defaults
(``generation_config``), which programs are compiled when (``warmup``, and
``compile_ahead`` for the programs a draining batch will need), one engine or several
(``replicas``), and saving an engine's weights (``save_checkpoint``)."""
