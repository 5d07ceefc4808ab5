"""Who may ask for ``guaranteed=yes``: the users, accounts and QOS an admin lists, each with
a GPU quota (config ``guarantees``).

Anyone can write ``guaranteed=yes`` in a job's ``#ELASTIC`` line; it binds the scheduler
only for the jobs this policy grants. Grants go in submission order. A job is granted by
the first of its user, account and QOS that is listed and still has room under its quota
(the GPUs the job asked for, ``gpus=``, added to those of the guaranteed jobs granted
before it through the same entry). Any other job runs best effort, and the reason is
shown with its plan (``slurm-ext squeue``).
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

KINDS = ("users", "accounts", "qos")
_NOUN = {"users": "user", "accounts": "account", "qos": "QOS"}


@dataclass(frozen=True)
class GuaranteePolicy:
    """The admin's list: per kind, (name, GPU quota or None for no limit) pairs.

    The default lists nobody: ``guaranteed=yes`` then binds nothing.
    """

    users: tuple[tuple[str, int | None], ...] = ()
    accounts: tuple[tuple[str, int | None], ...] = ()
    qos: tuple[tuple[str, int | None], ...] = ()

    @classmethod
    def from_mapping(cls, raw: Mapping) -> "GuaranteePolicy":
        """``{"users": {"alice": 16}, "accounts": ["ml"], "qos": {"high": None}}``.

        Raises:
            ValueError: an unknown kind, a name that is not text, or a quota that is not a
                non-negative whole number (or null).
        """
        unknown = set(raw) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown kind {sorted(unknown)[0]!r}; use users, accounts, qos")
        out = {}
        for kind in KINDS:
            entries = raw.get(kind) or {}
            if isinstance(entries, (list, tuple)):
                entries = {name: None for name in entries}
            if not isinstance(entries, Mapping):
                raise ValueError(f"{kind}: give a mapping of name: GPU quota, or a list of names")
            pairs = []
            for name, quota in entries.items():
                if not isinstance(name, str) or not name.strip():
                    raise ValueError(f"{kind}: {name!r} is not a name")
                if quota is not None and (isinstance(quota, bool) or not isinstance(quota, int) or quota < 0):
                    raise ValueError(f"{kind}.{name}: give a GPU quota (a whole number >= 0) or null")
                if any(listed == name.strip() for listed, _ in pairs):  # 'alice' and 'alice '
                    raise ValueError(f"{kind}: {name.strip()!r} is listed twice")
                pairs.append((name.strip(), quota))
            out[kind] = tuple(sorted(pairs))
        return cls(**out)

    def quota(self, kind: str, name: str) -> tuple[bool, int | None]:
        """(listed, quota) of ``name`` among ``kind``."""
        for listed, quota in getattr(self, kind):
            if listed == name:
                return True, quota
        return False, None


@dataclass(frozen=True)
class GuaranteeClaim:
    """A job that asked for ``guaranteed=yes``."""

    job_id: int
    user: str
    account: str
    qos: str
    gpus: int  # the GPUs it asked for (0 when it named no count)
    submit_time_s: float


def grant_guarantees(policy: GuaranteePolicy, claims: Iterable[GuaranteeClaim]) -> dict[int, str | None]:
    """Job id → None when its guarantee holds, else why it runs best effort."""
    used: dict[tuple[str, str], int] = {}
    out: dict[int, str | None] = {}
    for claim in sorted(claims, key=lambda c: (c.submit_time_s, c.job_id)):
        refusals = []
        for kind, name in (("users", claim.user), ("accounts", claim.account), ("qos", claim.qos)):
            listed, quota = policy.quota(kind, name) if name else (False, None)
            if not listed:
                continue
            held = used.get((kind, name), 0)
            if quota is None or held + claim.gpus <= quota:
                used[(kind, name)] = held + claim.gpus
                out[claim.job_id] = None
                break
            refusals.append(f"{_NOUN[kind]} {name}'s guarantee quota is {quota} GPUs and "
                            f"{held} are guaranteed to earlier jobs")
        else:
            if refusals:
                out[claim.job_id] = f"guarantee refused ({'; '.join(refusals)}): best effort"
            else:
                out[claim.job_id] = (f"guarantee refused (user {claim.user or '?'}, account "
                                     f"{claim.account or '-'}, QOS {claim.qos or '-'} not listed by "
                                     "the site): best effort")
    return out
