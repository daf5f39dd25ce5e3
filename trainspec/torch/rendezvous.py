"""Joining a torch.distributed job over a TCPStore that listens where the job says.

`init_process_group(init_method="tcp://127.0.0.1:PORT")` makes rank 0's TCPStore listen on
every interface whatever host it is given (torch 2.13): a local job would accept connections
from anywhere. So rank 0 binds the listening socket itself, on the coordinator's address (or
TRAINSPEC_COORDINATOR_BIND: trainspec.core.launch.coordinator_bind), and hands it to the store
(`master_listen_fd`); the other ranks connect as before.
"""
from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

from trainspec.core.errors import UserInputError
from trainspec.core.launch import coordinator_bind, split_host_port


def _listening_socket(address: str) -> socket.socket:
    host, port = split_host_port(address)
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(info[0], socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(info[4])
    except (OSError, ValueError) as err:
        raise UserInputError(f"the coordinator cannot listen on {address} ({err}); "
                             "TRAINSPEC_COORDINATOR_BIND names another address") from None
    listener.listen(128)
    return listener


def join(backend: str, coordinator: str, world: int, rank: int,
         timeout: datetime.timedelta) -> None:
    """Join the job of `world` ranks whose rank 0 listens at `coordinator` (host:port)."""
    host, port = split_host_port(coordinator)
    listener = _listening_socket(coordinator_bind(coordinator)) if rank == 0 else None
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout,
                          master_listen_fd=listener.fileno() if listener else None)
    if listener is not None:
        listener.detach()  # the store's server owns the descriptor now
    dist.init_process_group(backend, store=store, world_size=world, rank=rank, timeout=timeout)
