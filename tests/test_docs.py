"""docs/api.md's examples run as written, in order, in one namespace: the API page stays true.
(Its engine examples use the engine tests' model and geometry, so they share compiled steps.)"""

from __future__ import annotations

import pathlib
import re

API = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_api_examples_run(tmp_path, monkeypatch, torch_threads):
    blocks = re.findall(r"```python\n(.*?)```", API.read_text(), re.S)
    assert len(blocks) >= 8
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{API.name}, python block {i + 1}", "exec"), namespace)
