"""ZeroMQ plumbing: where each process's inbox lives and how sockets are made.

Each process binds one PULL socket (its inbox) and connects PUSH sockets to the inboxes it
sends to. Sockets are unix-domain (`ipc://`) in a private temporary directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq

from minfer.ipc.messages import Message, decode, encode

INBOX_NAMES = ("api", "tokenizer", "scheduler", "detokenizer")  # one socket file each


@dataclass(frozen=True)
class Endpoints:
    """The inbox address of each process."""

    api: str
    tokenizer: str
    scheduler: str
    detokenizer: str

    @classmethod
    def in_dir(cls, directory: str) -> Endpoints:
        return cls(*(f"ipc://{os.path.join(directory, name)}" for name in INBOX_NAMES))


def inbox(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)  # never drop or block: queues are bounded by admitted requests
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    return sock


def outbox(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def send(sock: zmq.Socket, msg: Message) -> None:
    sock.send(encode(msg), copy=False)


def recv_ready(sock: zmq.Socket, inbox: str, timeout_ms: int = 0) -> list[Message]:
    """Every message waiting in `sock` (the inbox named `inbox`, see messages.INBOX_MESSAGES),
    waiting up to `timeout_ms` for the first (-1: forever)."""
    if not sock.poll(timeout_ms, zmq.POLLIN):
        return []
    msgs = []
    while True:
        try:
            msgs.append(decode(sock.recv(zmq.NOBLOCK), inbox))
        except zmq.Again:
            return msgs


def fail_start(sock: zmq.Socket, role: str, error: Exception) -> None:
    """A worker could not start: tell the api server why (through `sock`), then exit with 1."""
    from minfer.ipc.messages import WorkerFailed

    send(sock, WorkerFailed(role=role, message=f"{type(error).__name__}: {error}"))
    sock.close(linger=2000)  # deliver the failure before exiting
    raise SystemExit(1) from None
