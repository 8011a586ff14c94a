"""Markers and fixtures of the test suite (helpers that tests import live in ``qops.testing``).

- ``@pytest.mark.gpu`` tests need CUDA: they are skipped (with the reason shown under -rs) when
  torch sees no GPU, and they are run on the lent H100 by tools/device_run.sh.
- ``QOPS_TEST_COMPILE=1`` reruns the suite with every op wrapper ``qops.<op>`` replaced by
  ``torch.compile(wrapper, fullgraph=True)`` (as FlashInfer's conftest does): every test that calls
  an op through its wrapper then exercises the op's fake, schema and compiled call as well.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import qops  # registers the ops

HAS_CUDA = torch.cuda.is_available()

try:  # hypothesis profiles for the property tests: "sanitize" keeps them short under compute-sanitizer
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("sanitize", max_examples=4, deadline=None)
except ImportError:
    pass
TEST_COMPILE = os.environ.get("QOPS_TEST_COMPILE") == "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine: tools/device_run.sh)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def pytest_report_header(config):
    return f"qops: QOPS_TEST_COMPILE={'1: op wrappers run through torch.compile' if TEST_COMPILE else '0'}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def _compiled(wrapper):
    """``torch.compile(wrapper, fullgraph=True)``; an error that the op raises while being traced
    (a bad argument the test expects) is re-raised as the op's own exception, as eager would."""
    compiled = torch.compile(wrapper, fullgraph=True, dynamic=False)

    @functools.wraps(wrapper)
    def call(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:  # the op's error, raised at trace time
            cause = e.__cause__ or e.__context__
            while isinstance(cause, torch._dynamo.exc.TorchDynamoException):
                cause = cause.__cause__ or cause.__context__
            if isinstance(cause, (ValueError, TypeError, NotImplementedError, KeyError)):
                raise cause from None
            raise

    return call


@pytest.fixture(autouse=True, scope="session")
def _compile_op_wrappers():
    if not TEST_COMPILE:
        yield
        return
    patch = pytest.MonkeyPatch()
    # Every test brings new shapes and dtypes: one compiled graph each, far past dynamo's default
    # limit of 8 recompilations per wrapper (a hard error under fullgraph=True).
    patch.setattr(torch._dynamo.config, "recompile_limit", 100_000)
    patch.setattr(torch._dynamo.config, "accumulated_recompile_limit", 1_000_000)
    for name in qops.op_names():
        patch.setattr(qops, name, _compiled(getattr(qops, name)))
    yield
    patch.undo()
