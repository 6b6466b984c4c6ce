"""Credentials in messages: every secret hidden, and no message garbled by a short one.

A secret long enough not to occur by chance (4 characters, 6 for digits) is hidden wherever it
appears; a shorter one is hidden where it stands as a value (after ``=`` or ``:``, or quoted),
never inside other words or numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

from growcache import SourceError
from growcache._retry import Redactor
from growcache.sources import ObjectSource


@pytest.mark.parametrize("secret", ["a", "ab", "s3", "pw!"])
def test_a_short_secret_is_hidden_as_a_value_and_leaves_other_words_alone(secret):
    redact = Redactor({"secret": secret})
    text = f"reading s3://bucket/data.npy failed: access denied for secret={secret} (attempt 3 of 6)"
    assert redact(text) == "reading s3://bucket/data.npy failed: access denied for secret=*** (attempt 3 of 6)"
    assert redact(f"{{'secret': '{secret}', 'anon': False}}") == "{'secret': '***', 'anon': False}"
    assert redact(f'token: "{secret}"') == 'token: "***"'
    assert redact(f"https://h/x?sig={secret}&v=1") == "https://h/x?sig=***&v=1"


def test_a_short_numeric_secret_is_hidden_as_a_value_and_numbers_stay():
    redact = Redactor({"password": 1234, "client_kwargs": {"token": "77"}})
    assert redact("login failed: password=1234 rejected at byte offset 12345") == \
        "login failed: password=*** rejected at byte offset 12345"
    assert redact("{'password': 1234, 'token': '77'}; shard 00077, 1234 records") == \
        "{'password': ***, 'token': '***'}; shard 00077, 1234 records"


def test_long_secrets_and_url_user_info_are_hidden_everywhere():
    redact = Redactor({"key": "AKIA-id-123", "password": 81234567}, ["https://me:pw@host/data"])
    assert redact("xAKIA-id-123y 81234567 https://me:pw@host/data pw=pw") == "x***y *** https://***@host/data pw=***"


def test_a_store_error_with_a_one_character_secret_stays_readable(tmp_path):
    missing = tmp_path / "data" / "a.npy"
    source = ObjectSource(f"file://{missing}", storage_options={"token": "a"})
    with pytest.raises(SourceError) as caught:
        source(np.random.default_rng(0))
    assert str(missing) in str(caught.value), str(caught.value)
