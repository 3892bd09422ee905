// MCP with the stock JS SDK (docs/design/mcp-gateway.md): `Sandbox.create({ mcp })` picks the `mcp-gateway` template
// and starts the gateway; MCP's Streamable HTTP (JSON-RPC over POST, answers as JSON or SSE) at `getMcpUrl()`'s
// path with `getMcpToken()` lists and calls the servers' tools, through the server's listener with the port URL
// as Host; without the token, 401.

import { after, describe, it } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'

import { Sandbox } from 'e2b/dist/index.mjs'

import { server } from './port_url.mjs'

const STEP = { timeout: 180_000 }

// One JSON-RPC message to the MCP endpoint: { status, headers, message } (the message from JSON or from SSE).
function rpc(host, path, headers, body) {
  return new Promise((resolve, reject) => {
    const req = http.request({
      host: server.hostname, port: server.port, path, method: 'POST',
      headers: { host, 'content-type': 'application/json', accept: 'application/json, text/event-stream', ...headers },
    }, (res) => {
      let text = ''
      res.on('data', (c) => (text += c))
      res.on('end', () => {
        const data = (res.headers['content-type'] ?? '').startsWith('text/event-stream')
          ? text.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5)).join('')
          : text
        resolve({ status: res.statusCode, headers: res.headers, message: data ? JSON.parse(data) : null })
      })
    })
    req.on('error', reject)
    req.setTimeout(60_000, () => req.destroy(new Error('no answer in 60 s')))
    req.end(JSON.stringify(body))
  })
}

describe('MCP gateway (JS SDK)', () => {
  let sbx
  after(async () => { if (sbx) await sbx.kill() }, STEP)

  it('lists and calls a catalog server\'s tools with the token, and refuses without it', STEP, async () => {
    sbx = await Sandbox.create({ mcp: { time: {} }, timeoutMs: 300_000 })
    const url = new URL(sbx.getMcpUrl())
    assert.equal(url.protocol, 'https:')
    assert.equal(url.hostname.split('.')[0], `50005-${sbx.sandboxId}`)
    const token = await sbx.getMcpToken()
    assert.ok(token)
    const host = sbx.getHost(50005)
    const auth = { authorization: `Bearer ${token}` }
    const init = await rpc(host, url.pathname, auth, {
      jsonrpc: '2.0', id: 1, method: 'initialize',
      params: { protocolVersion: '2025-06-18', capabilities: {}, clientInfo: { name: 'keepstate-js-test', version: '1' } },
    })
    assert.equal(init.status, 200, JSON.stringify(init.message))
    const session = init.headers['mcp-session-id']
    const withSession = session ? { ...auth, 'mcp-session-id': session } : auth
    await rpc(host, url.pathname, withSession, { jsonrpc: '2.0', method: 'notifications/initialized' })
    const tools = await rpc(host, url.pathname, withSession, { jsonrpc: '2.0', id: 2, method: 'tools/list' })
    const names = tools.message.result.tools.map((t) => t.name)
    assert.ok(names.includes('get_current_time'), names.join(', '))
    const called = await rpc(host, url.pathname, withSession, {
      jsonrpc: '2.0', id: 3, method: 'tools/call', params: { name: 'get_current_time', arguments: { timezone: 'UTC' } },
    })
    assert.equal(JSON.parse(called.message.result.content[0].text).timezone, 'UTC')
    const refused = await rpc(host, url.pathname, {}, { jsonrpc: '2.0', id: 4, method: 'tools/list' })
    assert.equal(refused.status, 401)
  })
})
