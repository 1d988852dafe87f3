# The test hosts' connection: containers.podman.podman with pipelining.
#
# Why: the collection's plugin runs `podman exec` without -i, so it cannot pipe
# a module to the host's python and says has_pipelining = False. Each task then
# costs four podman calls (mkdir, put, chmod+run, rm), about 1 s on the 2-core
# test machine. With -i when there is input, a module is one `podman exec -i`:
# ansible pipelines (this plugin's pipelining option defaults to true) and a
# 46-task probe play took 42 s instead of 78 s. Molecule's podman driver names
# the connection `podman`, which ANSIBLE_CONNECTION_PLUGINS finds here before the
# collection's redirect.
# Everything else (mount, put_file, fetch_file) is the collection's.
from __future__ import annotations

import shlex

from ansible.module_utils.common.text.converters import to_native
from ansible.plugins.connection import ConnectionBase, ensure_connect
from ansible_collections.containers.podman.plugins.connection.podman import (
    Connection as _CollectionPodman,
)

# Ansible reads a plugin's options from this string's text (not by import), so
# the collection's options are repeated here, shortened, with pipelining added.
DOCUMENTATION = """
    name: podman
    short_description: containers.podman.podman with pipelining (podman exec -i)
    description:
        - The collection's podman connection; a module is piped to the host's python.
    options:
      remote_addr:
        description: The container.
        default: inventory_hostname
        vars:
          - name: ansible_host
          - name: inventory_hostname
          - name: ansible_podman_host
      remote_user:
        description: User inside the container.
        ini:
          - section: defaults
            key: remote_user
        env:
          - name: ANSIBLE_REMOTE_USER
        vars:
          - name: ansible_user
      podman_extra_args:
        description: Extra arguments to pass to the podman command line.
        default: ''
        ini:
          - section: defaults
            key: podman_extra_args
        vars:
          - name: ansible_podman_extra_args
        env:
          - name: ANSIBLE_PODMAN_EXTRA_ARGS
      podman_executable:
        description: Executable for podman command.
        default: podman
        vars:
          - name: ansible_podman_executable
        env:
          - name: ANSIBLE_PODMAN_EXECUTABLE
      pipelining:
        description: Pipe modules to the host's python (one podman exec per task).
        default: true
        type: boolean
        ini:
          - section: connection
            key: pipelining
          - section: defaults
            key: pipelining
        env:
          - name: ANSIBLE_PIPELINING
        vars:
          - name: ansible_pipelining
"""


class Connection(_CollectionPodman):
    transport = "podman"
    has_pipelining = True

    @ensure_connect
    def exec_command(self, cmd, in_data=None, sudoable=False):
        ConnectionBase.exec_command(self, cmd, in_data=in_data, sudoable=sudoable)
        args = ["exec"]
        if in_data is not None:
            args.append("-i")
        if self.user:
            args.extend(("--user", self.user))
        argv = shlex.split(to_native(cmd, errors="surrogate_or_strict"))
        return self._podman(args, argv, in_data)
