"""The proxy's ``/metrics``: every instance's Prometheus metrics in one exposition, each
sample labelled with the instance's ``role`` (prefill / decode) and ``instance`` (its
URL), plus ``jaxpage:proxy_instance_up`` per instance (1 when its metrics were read) and
``jaxpage:proxy_prefix_routed_requests`` per role (requests sent to an instance that
recently took their prefix rather than to the least loaded one).

Families are merged by name across instances (Prometheus wants each family's samples
together, under one HELP and TYPE line); an instance that cannot be reached contributes
only its ``up`` sample, so a scrape never fails because one instance is down.
"""

from __future__ import annotations

import asyncio
import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

UP_METRIC = "jaxpage:proxy_instance_up"
ROUTED_METRIC = "jaxpage:proxy_prefix_routed_requests"


async def gather_metrics(client: httpx.AsyncClient, instances: list[tuple[str, str]],
                         headers: dict, prefix_routed: dict[str, int] | None = None) -> str:
    """``instances``: (role, url) pairs; ``prefix_routed``: role -> requests routed by
    prefix -> one Prometheus text exposition."""

    async def read(url: str) -> str | None:
        try:
            response = await client.get(url + "/metrics", headers=headers, timeout=10)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    texts = await asyncio.gather(*(read(url) for _, url in instances))
    families: dict[str, tuple[str, str, list[str]]] = {}  # name -> (type, help, samples)
    up = []
    for (role, url), text in zip(instances, texts):
        labels = {"role": role, "instance": url}
        up.append(_sample(UP_METRIC, labels, 0.0 if text is None else 1.0))
        if text is None:
            continue
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError:  # not Prometheus text: count the instance as down
            up[-1] = _sample(UP_METRIC, labels, 0.0)
            continue
        for family in parsed:
            entry = families.setdefault(family.name, (family.type, family.documentation, []))
            entry[2].extend(_sample(s.name, {**s.labels, **labels}, s.value)
                            for s in family.samples)
    lines = [f"# HELP {UP_METRIC} 1 when the proxy read the instance's metrics, else 0",
             f"# TYPE {UP_METRIC} gauge", *up]
    if prefix_routed is not None:
        lines += [f"# HELP {ROUTED_METRIC}_total Requests sent to an instance that recently "
                  "took their prefix rather than to the least loaded one",
                  f"# TYPE {ROUTED_METRIC}_total counter",
                  *(_sample(ROUTED_METRIC + "_total", {"role": role}, count)
                    for role, count in prefix_routed.items())]
    for name, (kind, documentation, samples) in families.items():
        # a counter's family is named without ``_total`` by the parser, with it in text
        header = f"{name}_total" if kind == "counter" else name
        lines.append(f"# HELP {header} {_escape_help(documentation)}")
        lines.append(f"# TYPE {header} {kind}")
        lines.extend(samples)
    return "\n".join(lines) + "\n"


def _sample(name: str, labels: dict[str, str], value: float) -> str:
    text = ",".join(f'{key}="{_escape_label(str(v))}"' for key, v in labels.items())
    return f"{name}{{{text}}} {_number(value)}"


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _escape_help(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n")
