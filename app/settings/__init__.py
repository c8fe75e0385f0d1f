"""One ``Settings`` object for the whole service.

Precedence, highest first: values passed to ``Settings(...)``, environment variables
(``AI_SERVICE_`` prefix, ``__`` between nested names, e.g.
``AI_SERVICE_BATCHING__NORMAL__WINDOW_MS=10``), then the TOML file named by
``AI_SERVICE_CONFIG_FILE`` (default ``config/default.toml``), then the defaults in
``app.settings.groups`` (the shipped file repeats the common ones; the README's table has
them all). Every field is validated; a bad
value stops start-up with a message naming the setting and the rule.

``groups``: the settings themselves; ``sources``: where they come from (variables, the config
file, secret files) and ``SettingsError``; ``loading``: building them, and naming a failure.
"""

from app.settings.groups import (
    MAX_BATCH,
    MIN_CONFIG_WATCH_S,
    AdminSettings,
    BatchingSettings,
    LaneSettings,
    LoggingSettings,
    ModelSettings,
    Seconds,
    ServerSettings,
    Settings,
    TelemetrySettings,
    check_windows,
)
from app.settings.loading import load_settings, read_settings, setting_location
from app.settings.sources import (
    CONFIG_FILE_ENV,
    DEFAULT_CONFIG_FILE,
    ENV_PREFIX,
    FileStamp,
    SettingsError,
    config_path,
    config_table_given,
    env_name,
    file_stamp,
    read_each_secret,
    read_secrets,
    read_stamped,
)

__all__ = [
    "CONFIG_FILE_ENV",
    "DEFAULT_CONFIG_FILE",
    "ENV_PREFIX",
    "MAX_BATCH",
    "MIN_CONFIG_WATCH_S",
    "AdminSettings",
    "BatchingSettings",
    "FileStamp",
    "LaneSettings",
    "LoggingSettings",
    "ModelSettings",
    "Seconds",
    "ServerSettings",
    "Settings",
    "SettingsError",
    "TelemetrySettings",
    "check_windows",
    "config_path",
    "config_table_given",
    "env_name",
    "file_stamp",
    "load_settings",
    "read_each_secret",
    "read_secrets",
    "read_settings",
    "read_stamped",
    "setting_location",
]
