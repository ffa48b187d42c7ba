"""Sealed messages (relax_hpc/transfer/seal.py): what opens, and each way a message may not."""

from __future__ import annotations

import pytest

from relax_hpc.transfer.seal import (
    PREFIX_BYTES,
    TAG_BYTES,
    TO_CLIENT,
    TO_SERVER,
    SealError,
    Sealer,
    key_id_of,
    new_session_key,
)

FRAMES = [b"header", bytes(range(256)) * 40, b""]


def pair(mode: str) -> tuple[Sealer, Sealer]:
    """(client, server) ends of one session."""
    key_id, key = new_session_key()
    return Sealer(key_id, key, mode, TO_SERVER), Sealer(key_id, key, mode, TO_CLIENT)


@pytest.mark.parametrize("mode", ["encrypt", "authenticate"])
def test_a_sealed_message_opens_to_its_frames_both_ways(mode: str) -> None:
    client, server = pair(mode)
    for _ in range(3):  # each message its own counter
        request = client.seal(FRAMES)
        assert [bytes(f) for f in server.open(request)] == FRAMES
        reply = server.seal(FRAMES[:1])
        assert [bytes(f) for f in client.open(reply)] == FRAMES[:1]
    assert key_id_of(request) == client.key_id and len(request[0]) == PREFIX_BYTES


def test_encrypt_hides_the_frames_and_authenticate_sends_them_as_they_are() -> None:
    secret = b"the prompt's answer is 42" * 10
    encrypted = pair("encrypt")[0].seal([secret])
    assert len(encrypted) == 2 and len(encrypted[1]) == len(secret) + TAG_BYTES
    assert b"answer" not in encrypted[1]
    tagged = pair("authenticate")[0].seal([secret, b"x"])
    # prefix, one tag per frame and one for the prefix, then the frames themselves
    assert len(tagged[1]) == 3 * TAG_BYTES and tagged[2:] == [secret, b"x"]


@pytest.mark.parametrize("mode", ["encrypt", "authenticate"])
def test_a_flipped_bit_in_any_frame_does_not_open(mode: str) -> None:
    client, server = pair(mode)
    sealed = client.seal(FRAMES)
    altered = 0
    for k, frame in enumerate(sealed):
        if not frame:  # the empty payload frame (authenticate): nothing to flip, its tag guards it
            continue
        message = [bytearray(f) for f in sealed]
        message[k][len(frame) // 2] ^= 0x01
        with pytest.raises(SealError):
            server.open(message)
        altered += 1
    assert altered == len(sealed) - (mode == "authenticate")
    assert [bytes(f) for f in server.open(sealed)] == FRAMES  # the untouched message still opens


@pytest.mark.parametrize("mode", ["encrypt", "authenticate"])
def test_a_replayed_or_reordered_message_is_refused(mode: str) -> None:
    client, server = pair(mode)
    first, second = client.seal([b"put 1"]), client.seal([b"put 2"])
    assert bytes(server.open(first)[0]) == b"put 1"
    with pytest.raises(SealError, match="replayed or reordered"):
        server.open(first)
    assert bytes(server.open(second)[0]) == b"put 2"
    third, fourth = client.seal([b"3"]), client.seal([b"4"])
    server.open(fourth)
    with pytest.raises(SealError, match="replayed or reordered"):
        server.open(third)  # older than one already accepted


@pytest.mark.parametrize("mode", ["encrypt", "authenticate"])
def test_a_dropped_or_added_frame_does_not_open(mode: str) -> None:
    client, server = pair(mode)
    whole = client.seal([b"header", b"payload"])
    with pytest.raises(SealError):
        server.open(whole[:-1])
    with pytest.raises(SealError):
        server.open([*whole, b"extra"])
    # The failures consumed nothing: the message itself still opens.
    assert [bytes(f) for f in server.open(whole)] == [b"header", b"payload"]


def test_an_edited_frame_count_does_not_open_even_with_the_frame_dropped() -> None:
    client, server = pair("authenticate")
    message = client.seal([b"header", b"payload"])
    prefix = bytearray(message[0])
    prefix[-1] = 1  # now says one frame
    tags = message[1][:TAG_BYTES] + message[1][2 * TAG_BYTES:]  # the first frame's tag and the prefix's
    with pytest.raises(SealError, match="does not verify"):
        server.open([bytes(prefix), tags, message[2]])


@pytest.mark.parametrize("mode", ["encrypt", "authenticate"])
def test_a_reply_reflected_back_is_not_a_request(mode: str) -> None:
    client, server = pair(mode)
    reply = server.seal([b"ok"])
    with pytest.raises(SealError):
        server.open(reply)  # the direction is in every nonce
    assert bytes(client.open(reply)[0]) == b"ok"


def test_another_sessions_key_or_mode_or_garbage_does_not_open() -> None:
    client, _ = pair("encrypt")
    _, other_server = pair("encrypt")
    with pytest.raises(SealError, match="not a sealed message of this session"):
        other_server.open(client.seal([b"x"]))
    key_id, key = new_session_key()
    encrypting = Sealer(key_id, key, "encrypt", TO_SERVER)
    authenticating = Sealer(key_id, key, "authenticate", TO_CLIENT)
    with pytest.raises(SealError, match="this session uses 'authenticate'"):
        authenticating.open(encrypting.seal([b"x"]))
    for garbage in ([], [b"\x00" * PREFIX_BYTES], [b"short"], [b"RTQ1" + b"\x00" * 100]):
        with pytest.raises(SealError):
            other_server.open(garbage)
        assert key_id_of(garbage) is None
    with pytest.raises(ValueError, match="seals nothing"):
        Sealer(key_id, key, "curve", TO_SERVER)
