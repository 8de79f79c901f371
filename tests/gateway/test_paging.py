"""`GET /v1/models` paging (Anthropic's `limit`, `after_id`, `before_id`), on a list of ids."""

from __future__ import annotations

import pytest

from mlx_worker_svc.gateway.errors import ApiError
from mlx_worker_svc.gateway.paging import Page, page

IDS = [f"m{i}" for i in range(25)]


def test_without_paging_parameters_the_page_is_every_model() -> None:
    assert page(IDS, {}) == Page(IDS, False)  # OpenAI clients read the list whole


@pytest.mark.parametrize(
    ("query", "want"),
    [
        ({"limit": "2"}, Page(["m0", "m1"], True)),
        ({"after_id": "m0"}, Page(IDS[1:21], True)),  # 20 by default once paging
        ({"after_id": "m20"}, Page(IDS[21:], False)),
        ({"after_id": "m24"}, Page([], False)),  # the last: nothing after it
        ({"after_id": "m22", "limit": "2"}, Page(["m23", "m24"], False)),
        ({"before_id": "m3", "limit": "2"}, Page(["m1", "m2"], True)),
        ({"before_id": "m2", "limit": "2"}, Page(["m0", "m1"], False)),
        ({"before_id": "m0"}, Page([], False)),
        ({"limit": "1000"}, Page(IDS, False)),
    ],
)
def test_a_page_holds_the_ids_asked_for(query: dict[str, str], want: Page) -> None:
    assert page(IDS, query) == want


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "1001"}, "limit"),
        ({"limit": "-5"}, "limit"),
        ({"limit": "abc"}, "limit"),
        ({"after_id": "nope"}, "after_id"),
        ({"before_id": "nope"}, "before_id"),
        ({"after_id": "m1", "before_id": "m3"}, "before_id"),
    ],
)
def test_a_bad_paging_parameter_is_a_400_naming_it(query: dict[str, str], param: str) -> None:
    with pytest.raises(ApiError) as refused:
        page(IDS, query)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert f"'{param}'" in refused.value.message
