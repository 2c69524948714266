from steadyrl.service import main_guard

from .worker import main

main_guard(main)
