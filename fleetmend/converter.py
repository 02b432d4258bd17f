"""The data converter every client and worker uses: Temporal's pydantic converter, so the contract's
pydantic models (`FaultEvent`, `DiagReport`) travel as themselves and dataclasses still work."""

from temporalio.contrib.pydantic import pydantic_data_converter as data_converter

__all__ = ["data_converter"]
