"""Install paths and built-in defaults, in one place (nvme-stas keeps its ``defs.py``
the same way): the Debian package, the config schema, the daemon, the clients and the
backend loader all take them from here. A leaf module: it imports nothing, so the
backends may use it like :mod:`inferd.ipc.errors`.
"""

from __future__ import annotations

SOCKET = "ipc:///run/inferd/inferd.sock"
"""The endpoint the daemon serves and the clients use by default."""

SOCKET_ENV = "INFERD_SOCKET"
"""Environment variable naming the endpoint for the clients and inferctl."""

CONFIG_FILE = "/etc/inferd/inferd.toml"
"""The system configuration file (read when it exists and no other is named)."""

CONFIG_ENV = "INFERD_CONFIG"
"""Environment variable naming the configuration file."""

REPOSITORY = "/var/lib/inferd/models"
"""The default model repository (``[models] repository``)."""

STATE_DIR = "/var/lib/inferd/state"
"""The daemon's own state (the unit's ``StateDirectory=inferd/state``): what backends
convert at first load and keep, one folder each (``ncnn/``)."""

PROCESSORS_DIR = "/usr/lib/inferd/processors"
"""The default directory of user processor files (``[processors] directory``)."""

BACKENDS_DIR = "/usr/lib/inferd/backends"
"""The default directory of backend plugins (searched when nothing else is named)."""

BACKENDS_PATH_ENV = "INFERD_BACKENDS_PATH"
"""Environment variable with a colon-separated backend search path."""

CUSTOMOPS_DIR = "/usr/lib/inferd/customops"
"""The default directory of custom operators (searched when nothing else is named)."""

CUSTOMOPS_PATH_ENV = "INFERD_CUSTOMOPS_PATH"
"""Environment variable with a colon-separated custom-operator search path."""
