from steadyrl.service import main_guard

from .main import main

main_guard(main)
