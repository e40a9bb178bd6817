"""``python -m service.cli``: the same command as the ``headroom`` console script."""

from service.cli.commands import main

if __name__ == "__main__":
    main()
