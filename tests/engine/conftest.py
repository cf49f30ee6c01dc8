import pytest

from jaxpage import LLM
from tests.options import TINY


@pytest.fixture(scope="module")
def tiny_llm(tiny_checkpoints):
    """A tiny Llama engine shared by a module's tests (cheap to compile)."""
    return LLM(tiny_checkpoints["llama"], **TINY)
