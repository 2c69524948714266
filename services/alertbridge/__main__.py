from steadyrl.service import main_guard

from .bridge import main

main_guard(main)
