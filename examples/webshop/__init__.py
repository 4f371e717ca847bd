"""A web shop for GUI tasks: the site in the sandbox, five tasks, a scripted agent, rewards from the site's state.

Example::

    import orchard
    import orchard.rollout
    import webshop

    async def main():
        agent = webshop.ScriptedShopper(p_right=0.5, seed=0, shots="runs/webshop/shots")
        async with orchard.Client("docker") as client:
            results = await orchard.rollout.run(
                client, webshop.load_tasks(), agent=agent, reward=webshop.reward, n=4, out="runs/webshop"
            )
        print(results.pass_rate)

``shop.py`` is the site (one stdlib-only file, run by the sandbox's python3);
``env.py`` starts it in a sandbox, reads its state and grades it; ``agent.py``
is the scripted agent (Playwright through ``orchard.gui.browser``).
"""

from .agent import ScriptedShopper
from .env import PORT, TASKS, URL, goal_of, load_tasks, read_state, reward, start_site

__all__ = ["PORT", "TASKS", "URL", "ScriptedShopper", "goal_of", "load_tasks", "read_state", "reward", "start_site"]
