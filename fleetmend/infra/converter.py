"""The data converter every client and worker uses: Temporal's pydantic converter, so the contract's
pydantic models (`FaultEvent`, `DiagReport`) travel as themselves and dataclasses still work.

The SDK builds a payload converter per workflow run, and each kept its own cache of pydantic
`TypeAdapter`s: every run paid again for building the schemas of its input, signals and results (a
fifth of the worker's CPU under a storm of new incidents, profiled with py-spy) and held them while
cached. Here one bounded cache serves the process, keyed by the type; the worker passes the
project's modules through the sandbox (`fleetmend.worker.workflow_runner`), so a message type is the
same class object in every run and the cache hits.
"""

from __future__ import annotations

import functools

from pydantic import TypeAdapter
from temporalio.contrib.pydantic import PydanticJSONPlainPayloadConverter, PydanticPayloadConverter
from temporalio.converter import DataConverter

SHARED_TYPE_ADAPTERS = 512
"""TypeAdapters kept process-wide (least recently used dropped first)."""

_type_adapter = functools.lru_cache(maxsize=SHARED_TYPE_ADAPTERS)(TypeAdapter)


class SharedCachePayloadConverter(PydanticPayloadConverter):
    """`PydanticPayloadConverter` whose JSON converter uses the one process-wide TypeAdapter cache."""

    def __init__(self) -> None:
        super().__init__()
        for conv in self.converters.values():
            if isinstance(conv, PydanticJSONPlainPayloadConverter):
                conv._type_adapter = _type_adapter


data_converter = DataConverter(payload_converter_class=SharedCachePayloadConverter)

__all__ = ["data_converter", "SharedCachePayloadConverter"]
