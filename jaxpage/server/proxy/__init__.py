"""Disaggregated serving's front: ``jaxpage proxy`` (``app``), one OpenAI-compatible
server in front of prefill and decode instances, that runs each request's prompt on a
prefill instance and its decoding on a decode instance, handing the KV pages over by
ticket; which instance of a role takes a request (``routing``: least loaded, or the one
that recently took the same prefix); the instances' metrics in one exposition
(``metrics``); and starting the proxy alone or with local instances (``disaggregated``)."""
