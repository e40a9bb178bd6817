"""Start headroom at login: the per-OS service definitions (:mod:`.definitions`,
rendered from the templates of ``installers/templates``) and what installs, removes,
starts and stops them (:mod:`.manager`), behind ``headroom service ...``.

Light at import (standard library and platformdirs): the CLI imports it.
"""
