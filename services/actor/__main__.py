from steadyrl.service import main_guard
from steadyrl.services.actor.server import main

main_guard(main)
