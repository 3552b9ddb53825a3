"""README.md as a newcomer's first screen: short, with the three features
and the two commands (run the main job, run the tests) on its first 40
lines, and every result file it cites committed."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_at_most_250_lines():
    assert len(README.splitlines()) <= 250


def test_features_and_commands_on_the_first_screen():
    first = "\n".join(README.splitlines()[:40])
    for needle in ("from_dlpack", "foreign(", "share(", "python -m jax_overlay", "tools/test.sh"):
        assert needle in first, needle


def test_cited_result_files_exist():
    cited = set(re.findall(r"benchmarks/results/[\w.\-]+\.(?:txt|json|png)", README))
    assert cited
    missing = sorted(c for c in cited if not (ROOT / c).exists())
    assert not missing, missing
