"""Admission to a job's rendezvous: its members prove the job secret.

The launcher gives every member of a job one secret (JBPS_JOB_SECRET; `jbps
run` draws one itself). The secret never travels. The scheduler opens each
connection with a fresh random challenge, and a member answers with its hello
and HMAC-SHA256(secret, challenge + hello): a proof holds for one connection
only, so a hello recorded on the wire and replayed is refused. The member's
hello carries a challenge of its own, and the scheduler's answers (the job
token, the server list, ranks) carry HMAC(secret, that challenge + answer): a
member takes a job only from a scheduler that knows the secret too. The two
sides' proofs are labelled apart, so one can never stand in for the other.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets

MIN_SECRET_CHARS = 16
CHALLENGE_BYTES = 32
SECRET_HINT = "python -c 'import secrets; print(secrets.token_hex(16))'"


def check_secret(text: str) -> str:
    """The secret as given; ValueError (that does not repeat it) when too short to be one."""
    if len(text) < MIN_SECRET_CHARS:
        raise ValueError(f"is {len(text)} characters; a job secret needs at least {MIN_SECRET_CHARS} ({SECRET_HINT})")
    return text


def new_secret() -> str:
    return secrets.token_hex(16)


def new_challenge() -> str:
    return secrets.token_hex(CHALLENGE_BYTES)


def _mac(secret: str, side: str, challenge: str, message: dict) -> str:
    body = json.dumps({k: v for k, v in message.items() if k != "proof"}, sort_keys=True)
    return hmac.new(secret.encode(), f"jbps {side}\n{challenge}\n{body}".encode(), hashlib.sha256).hexdigest()


def signed(secret: str, side: str, challenge: str, message: dict) -> dict:
    """`message` with its proof: `side` ("member" or "scheduler") answering `challenge`."""
    return {**message, "proof": _mac(secret, side, challenge, message)}


def proven(secret: str, side: str, challenge: str, message: dict) -> bool:
    proof = message.get("proof")
    return isinstance(proof, str) and hmac.compare_digest(proof, _mac(secret, side, challenge, message))
