"""Which store the slot directories belong to. A store's identity is a random id in
`<path>/store-id`, made once by the first process that needs it (kept exclusive with a hard
link, so two engines starting at once agree on it). Each slot directory (`slot_dirs`) carries a
marker naming that id and its place in the list: a directory that holds another store's slots,
or the same directories listed in another order (a mount point that moved), is refused before a
byte is written, rather than serving misses from the wrong files. Raw devices carry the same in
a header (devices.py).
"""

from __future__ import annotations

import os
import uuid

from . import layout as L

MARKER = "iud-kv-slots.json"


def store_id(root: str) -> str:
    """The store's id, created on first use; every process gets the same one."""
    path = os.path.join(root, "store-id")
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(uuid.uuid4().hex + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if another process made it first: its id wins
        except FileExistsError:
            pass
    except OSError as e:
        raise L.StoreUnavailable(f"vLLM KV store: cannot write {L.explain(e, path)}") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    with open(path) as f:
        return f.read().strip()


def member_problem(have: dict, sid: str, root: str, where: str, k: int, members: list) -> str:
    """'' if a marker or device header `have` says `where` is member k of this store, else why
    not (the same text for directories and devices)."""
    if have.get("store_id") != sid:
        return (
            f"{where} holds the slots of another store (store id {have.get('store_id')}, "
            f"made at {have.get('store')!r}), not of the store at {root!r}"
        )
    j = have.get("member")
    if j != k:
        return (
            f"{where} is member {j} of this store's {len(members)}, but is listed at position "
            f"{k}: list them in the store's order {members!r}"
        )
    return ""


def claim_dirs(root: str, geo: L.Geometry) -> None:
    """Creates or checks the marker of every slot directory (see the module doc)."""
    sid, dirs = store_id(root), list(geo.slot_dirs)
    for k, d in enumerate(dirs):
        path = os.path.join(d, MARKER)
        try:
            os.makedirs(d, exist_ok=True)
            have = L.read_json(path)
        except OSError as e:
            raise L.StoreUnavailable(f"vLLM KV store: cannot open {L.explain(e, d)}") from None
        if have is None:
            wanted = {"store_id": sid, "store": os.path.abspath(root), "member": k, "of": dirs}
            L.write_json(path, wanted, "vLLM KV store")
            continue
        problem = member_problem(have, sid, root, f"slot directory {d!r}", k, dirs)
        if problem:
            raise L.StoreMismatch(
                f"vLLM KV store: {problem}. Give each store its own slot directories (or delete "
                f"{path} and that store's rank folders there to reuse it)."
            )
