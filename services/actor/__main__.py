from steadyrl.services.actor.server import main
from steadyrl.service import main_guard

main_guard(main)
