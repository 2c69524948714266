from steadyrl.service import main_guard
from steadyrl.services.actor.main import main

main_guard(main)
