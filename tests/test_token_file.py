"""The local token file: created private and reused, an invalid one replaced, concurrent
creators agree on one token.
"""

from __future__ import annotations

import os
import stat
import sys


def test_token_created_private_and_reused(tmp_path, monkeypatch):
    from service.common import token as tk

    monkeypatch.setenv(tk.CONFIG_DIR_ENV, str(tmp_path / "cfg"))
    path = tk.token_path()
    assert path == tmp_path / "cfg" / "token"
    first = tk.load_or_create_token()
    assert len(first) >= 40 and tk.read_token() == first
    assert tk.load_or_create_token() == first  # reused
    assert not [p for p in path.parent.iterdir() if p.name != "token"]  # no temp left
    if sys.platform != "win32":
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        os.chmod(path, 0o644)  # someone widened it: narrowed again, token kept
        assert tk.load_or_create_token() == first
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_token_invalid_file_replaced(tmp_path):
    from service.common import token as tk

    path = tmp_path / "token"
    path.write_text("\n")
    fresh = tk.load_or_create_token(path)
    assert tk.read_token(path) == fresh
    path.write_text("not a token!\n")
    assert tk.read_token(path) is None
    assert tk.load_or_create_token(path) != fresh


def test_token_concurrent_creators_agree(tmp_path):
    import concurrent.futures

    from service.common import token as tk

    path = tmp_path / "t" / "token"
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        tokens = set(pool.map(lambda _: tk.load_or_create_token(path), range(32)))
    assert len(tokens) == 1
