"""deploy/init_secrets.py, run as the compose `secrets` service does on each start: the secrets
are created on the first start with owner-only modes, and a later start keeps them unchanged
(the running services and the Redis data depend on them)."""

from __future__ import annotations

import importlib.util
import stat

from dspark.serving.local_stack import REPO_ROOT

SECRET_FILES = ("api_keys", "redis_password", "redis.conf", "internal_token")


def load_init_secrets():
    """deploy/ is not a package: load deploy/init_secrets.py by path."""
    spec = importlib.util.spec_from_file_location("dspark_init_secrets",
                                                  REPO_ROOT / "deploy" / "init_secrets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_secrets_service(module, folder, monkeypatch) -> None:
    monkeypatch.setenv("DSPARK_SECRETS_DIR", str(folder))
    monkeypatch.delenv("DSPARK_API_KEYS", raising=False)
    assert module.main() == 0


def test_internal_token_is_created_once_and_kept(tmp_path, monkeypatch):
    module = load_init_secrets()
    run_secrets_service(module, tmp_path, monkeypatch)
    token_path = tmp_path / "internal_token"
    token = token_path.read_text().strip()
    assert len(token) >= 32
    first = {name: ((tmp_path / name).read_text(), (tmp_path / name).stat())
             for name in SECRET_FILES}
    for name, (_, status) in first.items():
        assert stat.S_IMODE(status.st_mode) == 0o600, name

    run_secrets_service(module, tmp_path, monkeypatch)  # the next start of the stack
    assert token_path.read_text().strip() == token
    # Not rewritten: same inode (no atomic replace) and same modification time.
    assert token_path.stat().st_ino == first["internal_token"][1].st_ino
    assert token_path.stat().st_mtime_ns == first["internal_token"][1].st_mtime_ns
    assert (tmp_path / "redis_password").read_text() == first["redis_password"][0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(SECRET_FILES)


def test_an_empty_internal_token_file_is_filled(tmp_path, monkeypatch):
    module = load_init_secrets()
    (tmp_path / "internal_token").write_text("\n")
    run_secrets_service(module, tmp_path, monkeypatch)
    assert len((tmp_path / "internal_token").read_text().strip()) >= 32


def test_two_stacks_get_different_tokens(tmp_path, monkeypatch):
    module = load_init_secrets()
    tokens = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        run_secrets_service(module, tmp_path / name, monkeypatch)
        tokens.append((tmp_path / name / "internal_token").read_text())
    assert tokens[0] != tokens[1]
