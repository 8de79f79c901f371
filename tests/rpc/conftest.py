"""The RPC tests' shared fixtures: the throwaway certificates (`pki`, once per module)."""

from __future__ import annotations

import pytest
from certificates import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))
