"""A storage node that serves IO_URING_DMABUF-backed files and block devices to remote NIXL agents.

server.StorageNode is the node (a NIXL agent with the storage backend and UCX); client.StorageClient
is the library a compute node uses to READ/WRITE blocks by (file, offset, length) into its own
memory. Messages are NIXL notifications (protocol.py); metadata goes through NIXL's etcd support or
its socket exchange. See docs/remote-storage.md.
"""

from .client import NodeUnreachable, RequestTimeout, StorageClient, StorageError  # noqa: F401
