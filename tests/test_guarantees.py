"""guaranteed=yes binds only for the users, accounts and QOS the admin lists, within quotas."""

import pytest

from slurm_ext.config import ConfigError, resolve
from slurm_ext.guarantees import GuaranteeClaim, GuaranteePolicy, grant_guarantees


def claim(job_id, user="alice", account="", qos="normal", gpus=8, at=None):
    return GuaranteeClaim(job_id, user, account, qos, gpus, float(at if at is not None else job_id))


def test_nobody_is_listed_by_default_so_nothing_is_guaranteed():
    why = grant_guarantees(GuaranteePolicy(), [claim(1)])
    assert why[1].startswith("guarantee refused") and "user alice" in why[1] and "best effort" in why[1]


def test_a_users_quota_is_spent_in_submission_order():
    policy = GuaranteePolicy.from_mapping({"users": {"alice": 16}})
    got = grant_guarantees(policy, [claim(3, at=30), claim(1, at=10), claim(2, at=20, gpus=4)])
    assert got[1] is None and got[2] is None  # 8 + 4 of 16
    assert "alice's guarantee quota is 16 GPUs and 12 are guaranteed to earlier jobs" in got[3]


def test_an_account_or_qos_grants_what_the_user_entry_cannot():
    policy = GuaranteePolicy.from_mapping({"users": {"alice": 8}, "accounts": {"ml": 8}, "qos": ["high"]})
    got = grant_guarantees(policy, [
        claim(1, account="ml"),                 # alice's own 8
        claim(2, account="ml"),                 # alice full: the account's 8
        claim(3, account="ml"),                 # both full, QOS normal not listed
        claim(4, user="bob", qos="high", gpus=64),  # QOS without a quota
    ])
    assert got[1] is None and got[2] is None and got[4] is None
    assert "user alice's guarantee quota is 8" in got[3] and "account ml's" in got[3]


def test_a_name_listed_twice_is_refused():
    for users in ({"alice": 4, "alice ": None}, {"alice": 4, " alice": 64}):
        with pytest.raises(ConfigError, match="'alice' is listed twice"):
            resolve({}, {}, {"guarantees": {"users": users}})


def test_the_config_key_reads_yaml_and_environment_and_names_bad_values():
    cfg = resolve({}, {}, {"guarantees": {"users": {"alice": 16}, "qos": ["high"]}})
    assert cfg.guarantees.quota("users", "alice") == (True, 16)
    assert cfg.guarantees.quota("qos", "high") == (True, None)
    env = resolve({}, {"SLURM_EXT_GUARANTEES": "{accounts: {ml: 32}}"}, {})
    assert env.guarantees.quota("accounts", "ml") == (True, 32)
    assert resolve({}, {}, {}).guarantees == GuaranteePolicy()
    for bad, match in (({"groups": ["x"]}, "unknown kind"), ({"users": {"alice": -1}}, "alice"),
                       ({"users": "alice"}, "mapping")):
        with pytest.raises(ConfigError, match=f"guarantees.*config file.*{match}"):
            resolve({}, {}, {"guarantees": bad})
