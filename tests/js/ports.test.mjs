// Port URLs with the stock E2B JS SDK (docs/design/network.md, "Inbound"): `getHost(port)` names
// `<port>-<id>.<domain>` of the server under test, and the router serves it; a sandbox created with
// `network.allowPublicTraffic: false` answers only requests carrying its `trafficAccessToken`. Requests go to the
// server's own address with the port URL as Host (no DNS).

import { after, describe, it } from 'node:test'
import assert from 'node:assert/strict'

import { Sandbox } from 'e2b/dist/index.mjs'

import { get } from './port_url.mjs'

const STEP = { timeout: 120_000 }

describe('port URLs (JS SDK)', () => {
  let sbx
  after(async () => { if (sbx) await sbx.kill() }, STEP)

  it('getHost names the server domain; the traffic token opens a private port', STEP, async () => {
    sbx = await Sandbox.create({ timeoutMs: 300_000, network: { allowPublicTraffic: false } })
    assert.ok(sbx.trafficAccessToken)
    const host = sbx.getHost(8000)
    assert.match(host, new RegExp(`^8000-${sbx.sandboxId}\\.`))
    await sbx.commands.run('python3 -m http.server 8000', { background: true })
    const token = { 'e2b-traffic-access-token': sbx.trafficAccessToken }
    const deadline = Date.now() + 60_000
    let answer
    for (;;) {
      answer = await get(host, '/', token)
      if (answer.status === 200 || Date.now() > deadline) break
      await new Promise((resolve) => setTimeout(resolve, 250))
    }
    assert.equal(answer.status, 200, answer.body)
    const refused = await get(host)
    assert.equal(refused.status, 403)
    assert.equal(JSON.parse(refused.body).code, 403)
  })
})
