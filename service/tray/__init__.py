"""The desktop tray: ``headroom tray`` (:mod:`service.tray.app`)."""
